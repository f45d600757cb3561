"""A run after staging: `genfleet runs`, `cancel` and `delete`."""
