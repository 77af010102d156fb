"""The users' roles on the bus (`permissions.py` says what each may do). Apart,
so the CLI lists them without importing the permission table."""

ROLES = (
    "admin",
    "operator",
    "scheduler",
    "saver",
    "recovery",
    "orchestrator",
    "gateway",
    "metrics",
    "host-agent",
    "tenant",
)
