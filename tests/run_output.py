"""What a driver's output may hold: raychat's own lines, by shape, and real warnings and errors.

An allow-list, not a list of Ray's lines to reject: a line of Ray's chatter that nobody has named yet
fails it. tests/test_train.py checks a 2-worker run with a killed worker against it.
"""

import re

from raychat.model.generate import SAMPLE_PROMPTS

RAYCHAT_LINES = [re.compile(p) for p in (
    # the driver, before Ray starts: corpus and tokenizer (prepared when missing), plan table, preset,
    # cadence, corpus budget
    r"^(No corpus in|No tokenizer in|Training tokenizer|Trained on|Saved tokenizer to|Tokenizer trained in) ",
    r"^sample: ",
    r"^Corpus: ",
    r"^(model|parameters|horizon|batch|optimizer)$",
    r"^  \S",  # the plan's rows and the summary's
    r"^Preset \w+: ",
    r"^Checkpoints: ",
    r"^Memory replicas: ",  # the driver's plan line, the loop's auto interval, a restore's choice
    r"^corpus: ",
    # the driver, at Ray's start: the one line in place of Ray's own (raychat.run.driver.ray_line)
    r"^Ray: (started a local instance|joined the cluster at \S+)(; dashboard http\S+( \(it asks for the "
    r"cluster's token: `ray get-auth-token` prints it\))?)?$",
    # each attempt: its one line, and on a restart what happened (raychat.elastic.signals.describe_attempt)
    r"^(Starting at step 0 \(no checkpoint\)|Starting from nanochat's weights at step 0|Resumed from "
    r"(\S+|peer memory) at step \d+ \((saved by|replicas of) \d+ workers, now \d+\)): training to step "
    r"\d+ at world size (?P<w>\d+) \((?P=w) worker\(s\) on \d+ node\(s\)\), \d+ rows/step on rank 0 in "
    r"micro-batches \[[\d, ]+\], "
    r"device \w+, \w+$",
    r"^(Lost \d+ worker\(s\)|A worker failed|Preempted \(saved step \d+ on the notice\)): continuing on \d+ "
    r"from step \d+ \(.+\); \d+ steps redone$",
    r"^(Grew|Resized) to \d+ workers at step \d+ \(no steps redone\)$",
    # a save on request (raychat.worker.fault_tolerance.FaultTolerance.save_on_request)
    r"^Preemption notice: saved step \d+( \(no deadline given: training on\)|, (training on|waiting for the "
    r"node to go) \(\d+s( before the node goes)?\))$",
    r"^Planned resize: saved step \d+, waiting for the new worker group$",
    # the loop: validation and CORE set-up, steps, evaluations, checkpoints
    r"^Validation: ",
    r"^CORE: \d+ tasks from ",
    r"^step \d{5}/\d{5} \(\d+\.\d{2}%\) \| loss: ",
    r"^Step \d{5} \| (Validation bpb|CORE metric): ",
    r"^Checkpoint cadence( changed from every \d+ steps)?: ",
    r"^Checkpoint checkpoint_\d+ saved ",
    # the summary
    r"^Training done\.$",
)]
# A real warning or error: Ray's log levels, Python's warnings and exceptions, a failure, raychat's own.
WARNING_OR_ERROR = re.compile(r"\b(WARNING|ERROR|\w*(Error|Warning|Exception)|warning|error|failed)\b"
                              r"|^raychat: |^\[[\d\- :,]+ [EW] \d+ \d+\] ")
# The rest of a warning's or error's record, from the same process: its traceback and details.
CONTINUATION = re.compile(r"^(\s|\^|\)|\.\.\. |Traceback \(most recent call last\):|[\w.]+(Error|Exception)\b"
                          r"|$)")
# Ray's prefix on a line another process printed: "(RayTrainWorker pid=123) ", "(raylet) ".
SOURCE = re.compile(r"^\((?P<source>[^)]*)\) (?P<text>.*)$")


def foreign_lines(output: str) -> list[str]:
    """The lines of `output` that are neither raychat's nor part of a real warning or error. The
    samples (a prompt, then the model's own text, which may run over several lines) are the run's too."""
    foreign, open_records, in_sample = [], set(), False
    for line in output.splitlines():
        match = SOURCE.match(line)
        source, text = (match["source"], match["text"]) if match else (None, line)
        if WARNING_OR_ERROR.search(line):
            open_records.add(source)
            continue
        if source in open_records and CONTINUATION.match(text):
            continue
        open_records.discard(source)
        if source is None and line.startswith(tuple(SAMPLE_PROMPTS)):
            in_sample = True
            continue
        ours = source is None and any(pattern.search(line) for pattern in RAYCHAT_LINES)
        in_sample = in_sample and source is None and not ours
        if not (ours or in_sample or not line.strip()):
            foreign.append(line)
    return foreign
