"""What each Ray Train worker runs: nanochat's base_train loop, world-size-independent.

    setup        a worker's set-up: model, optimizer, loader, checkpoint, sinks, and the loop state
    loop         the step loop: evaluate, sample, save if due, step, log
    step         one optimizer step in plain PyTorch
    state        what each rank saves and reads back
    core_metric  when the loop scores CORE, and the score across ranks
"""
