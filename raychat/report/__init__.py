"""A run's report: `python -m raychat.report --run-name R` reads the run's metrics log
(raychat.telemetry.metrics_log) and writes report.md with PNG plots, and prints the summary.

    plots      the run's figures (and the figure helpers tune.plots shares)
    summary    the numbers: model, horizon, throughput, evals, samples       (plots)
    findings   diagnostics as sentences with their numbers                    (summary)
    document   report.md and the PNGs, written locally or to a bucket         (all of the above)
    __main__   the command line                                               (document)
"""
