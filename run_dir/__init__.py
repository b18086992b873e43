"""The run directory's life: claiming it (claim.py), its lock and status.json (run_state.py), reading a run's
config.yaml back (run_config.py, with the migration of older runs' keys), what older versions wrote (past.py), the
session from claim to summary.json (lifecycle.py: trackers, rank roles, endings and exit codes) and a run read back,
its files named once (reader.py: `RunFiles`)."""
