"""What every training command stands on, in four rooms: ``plan`` (the cluster and the placement plan),
``learners`` (learner groups and their Ray worker, weight sync, memory phases), ``runs`` (the run skeleton,
its session, checkpoints, tracking, failures) and ``host`` (threads, cores, malloc, OpenMP)."""
