"""Checkpoints in the run's storage: the files and their manifest (format), the asynchronous writer
(saver), which checkpoint a restart resumes from (resume) and the note a stopped run leaves (stop_note).
"""
