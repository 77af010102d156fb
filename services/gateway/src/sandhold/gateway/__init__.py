"""sandhold gateway service."""
