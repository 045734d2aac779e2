"""Host tuning: torch threads and pinned cores per process, glibc malloc and OpenMP settings, and the bf16-on-a-slow-CPU warning."""
