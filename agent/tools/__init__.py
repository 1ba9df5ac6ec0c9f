"""The ``hpar-agent`` command and the offline tools (report, summary, diagnose, doctor, compare, demo
launching, export): they read a run's files after the fact and never run inside training, so the
runtime package never imports them (a test holds that)."""
