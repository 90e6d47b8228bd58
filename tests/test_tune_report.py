"""tune.fit's iso-FLOP analysis on synthetic sweeps with a known optimum, the plots read back from
their Figure objects (series per depth, axis labels, fitted points), and tune.report on a real Ray
Tune experiment directory (trials that report synthetic results, laid out by Tune itself)."""

import csv
import json
import math

import numpy as np
import pytest

from tune.fit import budget_optimum, compute_optimal, fit_power_law, r_squared
from tune.plots import DPI, bpb_vs_flops_figure, iso_flop_figure
from tune.report import SWEEP_SPEC_FILE, Trial, eval_curves, load_sweep, main, trial_row, write_report

BUDGETS = [1e17, 1e18, 1e19, 1e20]
SPREAD = [0.3, 0.6, 1.4, 2.5]  # model sizes tried, as multiples of the optimum (asymmetric on purpose)


def synthetic_points(exponent: float, k: float, curvature: float = 0.03, noise: float = 0.0, seed: int = 0):
    """An iso-FLOP sweep whose truth is known: N_opt = k * C^exponent; each model trains on
    D = C / (6N) tokens; val bpb is a parabola in ln N with its bottom at N_opt."""
    rng = np.random.default_rng(seed)
    points = []
    for c in BUDGETS:
        n_opt = k * c**exponent
        for m in SPREAD:
            n = n_opt * m
            bpb = 0.9 + 0.05 * math.log10(1e20 / c) + curvature * math.log(m) ** 2 + noise * rng.normal()
            points.append((c, n, c / (6 * n), bpb))
    return points


@pytest.mark.unit
def test_r_squared_by_hand():
    # residuals 0.1, 0.1, 0.2, 0.2 -> SS_res 0.10; mean 2.5 -> SS_tot 5.0
    assert r_squared([1, 2, 3, 4], [1.1, 1.9, 3.2, 3.8], 2) == pytest.approx(1 - 0.10 / 5.0)
    assert r_squared([1, 2, 3], [1, 2, 3], 3) is None  # as many coefficients as points


@pytest.mark.unit
def test_power_law_recovers_exponent_and_coefficient():
    x = np.array([1e2, 1e3, 1e4, 1e5])
    law = fit_power_law(x, 7.0 * x**0.37)
    assert law.exponent == pytest.approx(0.37, abs=1e-9)
    assert law.coefficient == pytest.approx(7.0, rel=1e-9)
    assert law.r2 == pytest.approx(1.0)
    assert law(1e6) == pytest.approx(7.0 * 1e6**0.37, rel=1e-9)


@pytest.mark.unit
def test_chinchilla_like_optimum_ratio_20():
    # N_opt = k C^0.5 and D = C/(6N): D_opt = C^0.5 / (6k), so D/N = 1/(6 k^2) = 20 at every budget.
    k = 1 / math.sqrt(120)
    result = compute_optimal(synthetic_points(0.5, k))
    for o, c in zip(result.optima, BUDGETS, strict=True):
        assert o.source == "fit"
        assert o.params == pytest.approx(k * c**0.5, rel=1e-6)
        assert o.tokens == pytest.approx(c**0.5 / (6 * k), rel=1e-6)
        assert o.ratio == pytest.approx(20.0, rel=1e-6)
        assert o.val_bpb == pytest.approx(0.9 + 0.05 * math.log10(1e20 / c), abs=1e-9)
        assert o.r2 == pytest.approx(1.0)
    assert result.params_law.exponent == pytest.approx(0.5, abs=1e-6)
    assert result.tokens_law.exponent == pytest.approx(0.5, abs=1e-6)
    assert result.ratio_exponent == pytest.approx(0.0, abs=1e-6)
    assert result.reference_flops == pytest.approx(10**18.5, rel=1e-9)  # geometric mean of the budgets
    assert result.ratio_at_reference == pytest.approx(20.0, rel=1e-6)
    assert result.params_law.r2 == pytest.approx(1.0) and result.tokens_law.r2 == pytest.approx(1.0)


@pytest.mark.unit
def test_ratio_that_drifts_with_compute():
    # N_opt = k C^0.6 -> D_opt = C^0.4 / (6k): b = 0.4, and D/N = C^-0.2 / (6 k^2) at the reference.
    k = 0.05
    result = compute_optimal(synthetic_points(0.6, k))
    assert result.params_law.exponent == pytest.approx(0.6, abs=1e-6)
    assert result.tokens_law.exponent == pytest.approx(0.4, abs=1e-6)
    assert result.ratio_exponent == pytest.approx(-0.2, abs=1e-6)
    c_ref = 10**18.5
    assert result.ratio_at_reference == pytest.approx(c_ref**-0.2 / (6 * k * k), rel=1e-6)


@pytest.mark.unit
def test_noisy_sweep_fits_close_with_imperfect_quality():
    k = 1 / math.sqrt(120)
    result = compute_optimal(synthetic_points(0.5, k, curvature=0.05, noise=0.002, seed=3))
    assert result.params_law.exponent == pytest.approx(0.5, abs=0.05)
    assert result.ratio_at_reference == pytest.approx(20.0, rel=0.3)
    assert all(o.r2 is not None and 0.9 < o.r2 < 1.0 for o in result.optima)
    assert 0.9 < result.params_law.r2 < 1.0


@pytest.mark.unit
def test_no_valley_or_too_few_points_falls_back_to_best_trial():
    # two sizes only: no parabola; the better trial is taken as is
    o = budget_optimum(1e18, [1e6, 2e6], [1e11, 5e10], [1.10, 1.05])
    assert (o.source, o.params, o.tokens, o.val_bpb) == ("best point", 2e6, 5e10, 1.05)
    # bpb still falling at the largest size: the parabola opens downward -> best point, not a maximum
    o = budget_optimum(1e18, [1e6, 2e6, 4e6], [4e11, 2e11, 1e11], [1.30, 1.25, 1.05])
    assert (o.source, o.params) == ("best point", 4e6)
    # a valley whose bottom is beyond the largest size tried is reported as extrapolated
    n = np.array([1e6, 2e6, 4e6])
    o = budget_optimum(1e18, n, 1e18 / (6 * n), 1.0 + 0.1 * np.log(n / 8e6) ** 2)
    assert o.source == "extrapolated"
    assert o.params == pytest.approx(8e6, rel=1e-6)
    # a single budget gives optima but no power laws
    result = compute_optimal(synthetic_points(0.5, 0.1)[:4])
    assert len(result.optima) == 1 and result.params_law is None and result.ratio_at_reference is None


# ------------------------------------------------------------------------------------------------
# tune.report on a real Ray Tune experiment directory

def synthetic_specs():
    """Trial specs in tune.sweep's format: 2 budgets x 3 depths with a known optimum per budget."""
    k = 1 / math.sqrt(120)  # compute-optimal ratio 20
    specs = []
    for c in (1e15, 4e15):
        n_opt = k * c**0.5
        for depth, m in ((2, 0.5), (3, 1.2), (4, 3.0)):
            n = n_opt * m
            specs.append({
                "name": f"f{c:.0e}_d{depth}".replace("+", ""), "depth": depth, "ratio": None,
                "flops_budget": c,
                "plan": {"n_embd": 64 * depth, "scaling_params": n, "total_params": 2 * n,
                         "flops_per_token": 6 * n},
                "fake": {"tokens": c / (6 * n),
                         "bpb": 1.0 + 0.02 * math.log(m) ** 2 + (0.1 if c == 1e15 else 0)},
            })
    return specs


EVAL_FRACTIONS = (0.25, 0.5, 1.0)  # a trial evaluates at a quarter, half and all of its budget


def synthetic_reports(spec):
    """What a trial of `spec` reports: val bpb falls by 0.3 x the budget still to spend; FLOPs so far
    are tokens x FLOPs/token = C / 6N x frac x 6N = C x frac."""
    tokens, bpb, fpt = spec["fake"]["tokens"], spec["fake"]["bpb"], spec["plan"]["flops_per_token"]
    return [{"val_bpb": bpb + 0.3 * (1 - frac), "tokens_so_far": tokens * frac,
             "flops_so_far": tokens * frac * fpt, "train_done": frac == 1.0 and not spec.get("cut")}
            for frac in EVAL_FRACTIONS]


def expected_evals(spec):
    return [(spec["flops_budget"] * frac, spec["fake"]["bpb"] + 0.3 * (1 - frac)) for frac in EVAL_FRACTIONS]


@pytest.mark.unit
def test_bpb_vs_flops_plot_draws_each_trials_evals_one_colour_per_depth():
    specs = synthetic_specs()
    trials = [Trial(s["name"], "finished", s, synthetic_reports(s)) for s in specs]
    trials.append(Trial("never_started", "not started", specs[0]))  # no evals: nothing drawn
    (ax,) = bpb_vs_flops_figure(eval_curves(trials)).axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training FLOPs", "validation bits per byte")
    assert ax.get_xscale() == "log"
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "depth"
    assert [t.get_text() for t in legend.get_texts()] == ["d2", "d3", "d4"]
    curves = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    dots = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert len(curves) == len(dots) == len(specs)
    colour_of_depth = {}
    for spec, curve, dot in zip(specs, curves, dots, strict=True):
        xs, ys = zip(*expected_evals(spec), strict=True)
        assert list(curve.get_xdata()) == pytest.approx(xs) and list(curve.get_ydata()) == pytest.approx(ys)
        assert list(dot.get_xdata()) == pytest.approx([spec["flops_budget"]])  # the last eval only
        assert list(dot.get_ydata()) == pytest.approx([spec["fake"]["bpb"]])
        assert curve.get_color() == pytest.approx(dot.get_color())
        colour_of_depth.setdefault(spec["depth"], []).append(tuple(curve.get_color()))
    assert all(len(set(colours)) == 1 for colours in colour_of_depth.values())  # a depth keeps its colour
    assert len({colours[0] for colours in colour_of_depth.values()}) == 3       # depths differ


@pytest.mark.unit
def test_iso_flop_plot_shows_trials_parabolas_optima_and_power_laws():
    # truth: N_opt = k C^0.5 with D/N = 20; bpb at the optimum 0.9 + 0.05 log10(1e20 / C)
    k = 1 / math.sqrt(120)
    points = synthetic_points(0.5, k)
    fig = iso_flop_figure(points, compute_optimal(points))
    valleys, n_opt, d_opt = fig.axes
    assert (valleys.get_xlabel(), valleys.get_ylabel()) == ("scaling parameters N", "final val bpb")
    assert [t.get_text() for t in valleys.get_legend().get_texts()] == ["1e+17", "1e+18", "1e+19", "1e+20"]
    trials = [line for line in valleys.get_lines() if line.get_marker() == "o"]
    parabolas = [line for line in valleys.get_lines() if line.get_linestyle() == "--"]
    stars = [line for line in valleys.get_lines() if line.get_marker() == "*"]
    assert len(trials) == len(parabolas) == len(stars) == len(BUDGETS)
    for c, dots, parabola, star in zip(BUDGETS, trials, parabolas, stars, strict=True):
        budget_points = sorted((n, bpb) for budget, n, _, bpb in points if budget == c)
        assert list(dots.get_xdata()) == [n for n, _ in budget_points]  # the trials' own numbers
        assert list(dots.get_ydata()) == [bpb for _, bpb in budget_points]
        best_bpb = 0.9 + 0.05 * math.log10(1e20 / c)
        assert star.get_xdata()[0] == pytest.approx(k * c**0.5, rel=1e-6)
        assert star.get_ydata()[0] == pytest.approx(best_bpb, abs=1e-9)
        # the dashed curve is the valley: through every trial's bpb, lowest at the star
        ln_n, curve = np.log(parabola.get_xdata()), parabola.get_ydata()
        assert curve.min() == pytest.approx(best_bpb, abs=1e-4)
        for n, bpb in budget_points:
            assert np.interp(math.log(n), ln_n, curve) == pytest.approx(bpb, abs=1e-3)
    for ax, name, unit, truth in ((n_opt, "N_opt", "parameters", lambda c: k * c**0.5),
                                  (d_opt, "D_opt", "tokens", lambda c: c**0.5 / (6 * k))):
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("training FLOPs C", f"{name} ({unit})")
        (optima,) = [line for line in ax.get_lines() if line.get_marker() == "o"]
        assert list(optima.get_xdata()) == BUDGETS
        assert list(optima.get_ydata()) == pytest.approx([truth(c) for c in BUDGETS], rel=1e-6)
        (law,) = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
        assert list(law.get_ydata()) == pytest.approx([truth(c) for c in law.get_xdata()], rel=1e-6)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"{name} ~ C^0.500, R^2 1.000"]
    assert fig.get_suptitle() == "compute-optimal tokens:params ratio 20.0 at C = 3.2e+18"


@pytest.fixture(scope="module")
def tune_experiment(ray_session, tmp_path_factory):
    """A Tune experiment whose trials report like tune.sweep trials: 6 finished iso-FLOP trials, one
    that fails and one that ends without its last step; plus one spec that never started."""
    import ray.tune as tune

    specs = synthetic_specs()
    failing = {**specs[0], "name": "broken", "fail": True}
    unfinished = {**specs[1], "name": "cut_short", "cut": True}
    never = {**specs[2], "name": "never_started"}

    def trial_fn(config):  # self-contained: Ray's workers cannot import this test module
        spec = config["trial"]
        for report in spec["reports"]:
            if spec.get("fail") and report["train_done"]:
                raise RuntimeError("synthetic failure")
            tune.report(report)

    storage = tmp_path_factory.mktemp("sweeps")
    path = storage / "synthetic"
    path.mkdir()
    (path / SWEEP_SPEC_FILE).write_text(json.dumps({"trials": [*specs, failing, unfinished, never]}))
    tuner = tune.Tuner(
        trial_fn,
        param_space={"trial": tune.grid_search([{**spec, "reports": synthetic_reports(spec)}
                                                for spec in (*specs, failing, unfinished)])},
        tune_config=tune.TuneConfig(trial_dirname_creator=lambda t: t.config["trial"]["name"]),
        run_config=tune.RunConfig(name="synthetic", storage_path=str(storage), verbose=0),
    )
    tuner.fit()
    return str(path), specs


@pytest.mark.ray
def test_load_sweep_reads_tune_layout(tune_experiment):
    path, specs = tune_experiment
    trials = {t.name: t for t in load_sweep(path)}
    assert set(trials) == {s["name"] for s in specs} | {"broken", "cut_short", "never_started"}
    assert {trials[s["name"]].status for s in specs} == {"finished"}
    assert trials["broken"].status == "error"
    assert trials["cut_short"].status == "stopped early"
    assert trials["never_started"].status == "not started"
    first = trials[specs[0]["name"]]
    assert len(first.results) == 3
    row = trial_row(first)
    tokens = specs[0]["fake"]["tokens"]
    assert row["val_bpb"] == pytest.approx(specs[0]["fake"]["bpb"])
    assert row["tokens"] == pytest.approx(tokens)
    assert row["tokens_per_param"] == pytest.approx(tokens / specs[0]["plan"]["scaling_params"])
    assert row["total_flops"] == pytest.approx(1e15)
    assert row["width"] == 128 and row["depth"] == 2


@pytest.mark.ray
def test_report_writes_table_csv_and_plots(tune_experiment, tmp_path, capsys):
    path, specs = tune_experiment
    out = tmp_path / "report"
    write_report(path, out)
    printed = capsys.readouterr().out
    with open(out / "trials.csv") as f:
        rows = {r["trial"]: r for r in csv.DictReader(f)}
    assert len(rows) == 9
    assert rows["broken"]["status"] == "error" and rows["never_started"]["val_bpb"] == ""
    assert float(rows[specs[4]["name"]]["val_bpb"]) == pytest.approx(specs[4]["fake"]["bpb"])

    # compute-optimal rows: the parabola through 3 exact points finds the known optimum
    with open(out / "compute_optimal.csv") as f:
        optima = list(csv.DictReader(f))
    k = 1 / math.sqrt(120)
    for o, c in zip(optima, (1e15, 4e15), strict=True):
        assert float(o["params_opt"]) == pytest.approx(k * c**0.5, rel=1e-6)
        assert float(o["ratio"]) == pytest.approx(20.0, rel=1e-6)
        assert o["trials"] == "3" and o["source"] == "fit"
    assert "Compute-optimal tokens:params ratio: 20.0" in printed
    assert "N_opt ~ C^0.500" in printed and "no fit quality" in printed  # 2 budgets: exact line

    # the bpb plot draws what the trials reported through Tune (the failed one up to its failure)
    trials = load_sweep(path)
    curves = dict(zip([t.name for t in trials], eval_curves(trials), strict=True))
    drawn = {spec["name"]: (spec["depth"], expected_evals(spec)) for spec in specs}
    drawn["broken"] = (specs[0]["depth"], expected_evals(specs[0])[:2])
    drawn["cut_short"] = (specs[1]["depth"], expected_evals(specs[1]))
    drawn["never_started"] = (specs[2]["depth"], [])
    assert set(curves) == set(drawn)
    for name, (depth, evals) in drawn.items():
        assert curves[name][0] == depth
        assert np.asarray(curves[name][1]).reshape(-1) == pytest.approx(np.asarray(evals).reshape(-1))

    import matplotlib.image

    # the PNGs are the figures at their size: 8 x 5.5 and 17 x 5 inches
    assert matplotlib.image.imread(out / "val_bpb_vs_flops.png").shape[:2] == (5.5 * DPI, 8 * DPI)
    assert matplotlib.image.imread(out / "iso_flop.png").shape[:2] == (5 * DPI, 17 * DPI)


@pytest.mark.ray
def test_report_cli_and_missing_sweep(tune_experiment, tmp_path, capsys):
    path, _ = tune_experiment
    storage, name = path.rsplit("/", 1)
    with pytest.raises(SystemExit) as e:
        from raychat.common import run_cli

        run_cli(main, ["--name", "no_such_sweep", "--storage-path", storage])
    assert e.value.code == 2
    assert "no sweep at" in capsys.readouterr().err
    assert main(["--name", name, "--storage-path", storage, "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "trials.csv").exists()
