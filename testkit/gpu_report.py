"""bench.gpu's acceptance row for bench/RESULTS.md, and nanochat's published figures it quotes.

`markdown_row` turns bench.gpu's JSON report into one row under ROW_HEADER: what each part measured,
or why it did not run (one GPU: no bus to measure, no other world size to resume at), beside
nanochat's own figure for the depth (NANOCHAT_PUBLISHED, labelled: never measured here). In testkit,
not bench/, because tests/test_bench_gpu.py checks the row of reports only a GPU node writes (one
GPU, nanochat's d12 quoted), which `python -m bench.gpu --dry-run` on CPU cannot produce, and tests
import nothing from bench/.
"""


# nanochat's own figures (karpathy/nanochat dev/LOG.md, read at 92d63d4, 2026-07-03): measured on
# nanochat's code, its 8 x H100 node and its corpus, never on this machine; printed beside raychat's
# as labelled references, never divided by.
NANOCHAT_LOG = "https://github.com/karpathy/nanochat/blob/master/dev/LOG.md"
NANOCHAT_PUBLISHED = {
    12: {"mfu": 41.0, "memory_gb": 34.0,
         "source": "nanochat dev/LOG.md 2026-01-12 (Multi-Token Prediction, d12 baseline): MFU 41%, GPU "
                   "memory 34 GB"},
    18: {"mfu": 46.0, "source": "nanochat dev/LOG.md 2026-02-19 (Mixture of Experts, d18 dense): MFU ~46%"},
    26: {"tok_per_sec": 630_000, "gpus": 8,
         "source": "nanochat dev/LOG.md 2026-02-02 (FP8, full training d26, BF16 baseline): 630K tok/s on "
                   "8 x H100 (~79K per GPU)"},
}

ROW_HEADER = ("| date | device | GPUs | process group | all-reduce busbw (largest) | train | tok/s | MFU "
              "| peak memory | nanochat, published (not measured here) | resume |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")


def markdown_row(report: dict) -> str:
    """One row of bench/RESULTS.md's acceptance table (ROW_HEADER)."""
    parts = report["parts"]
    pg, train, resume = (parts.get(name, {"skipped": "not run yet"}) for name in ("process_group", "train",
                                                                                   "resume"))

    def said(part: dict) -> str | None:  # a part that did not run: why
        return part.get("skipped") or (f"error: {part['error']}" if "error" in part else None)

    group = said(pg) or (f"{pg['backend']}, {pg['world_size']} rank(s) via TorchConfig"
                         f"{'' if pg['ok'] else ' FAILED'}")
    rows = pg.get("allreduce") or []
    busbw = (said(pg) or "n/a (1 rank)") if not rows else \
        f"{rows[-1]['busbw_gbps']:.1f} GB/s ({rows[-1]['bytes'] / 2**20:,.0f} MiB)"
    if said(train):
        what, tok, mfu, memory, reference = said(train), "", "", "", ""
    else:
        what = (f"d{train['depth']}, {train['precision']}{', compiled' if train['compiled'] else ''}, "
                f"{train['world_size']} worker(s), median of {train['timed_steps']} steps")
        tok, mfu = f"{train['tok_per_sec']:,.0f}", pct(train["mfu"])
        memory = "n/a" if train["peak_memory_gib"] is None else f"{train['peak_memory_gib']:.1f} GiB"
        reference = (train["nanochat_published"] or {}).get("source", f"none for d{train['depth']}")
    moved = said(resume) or (f"{resume['from_world_size']} -> {resume['world_size']} workers from "
                             f"{resume['resumed_from']}: {'ok' if resume['ok'] else 'FAILED'}")
    return (f"| {report['date']} | {report['device_name']} | {report['gpus']} | {group} | {busbw} | {what} "
            f"| {tok} | {mfu} | {memory} | {reference} | {moved} |")


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}%"
