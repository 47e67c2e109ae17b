"""Exit statuses of `python -m train`, which launchers and schedulers act on."""
OK = 0
USER_ERROR = 2      # a bad config, flag, file or directory: fix it, do not retry
REQUEUE = 75        # EX_TEMPFAIL: preempted after a checkpoint was saved; requeue the job
