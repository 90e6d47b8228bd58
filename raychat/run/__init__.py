"""The driver of one training run, shared by `python -m raychat.train` and every tune.sweep trial.

    prepare  every check the driver can make before Ray starts, and the run it prepared
    driver   Ray joined, the lease held, the trainer fit, the summary said
"""
