"""The job's health: preflight, startup facts, fault injection, the watchdog and the
step monitor, and calibrate's measurements."""
