"""sandhold orchestrator service."""
