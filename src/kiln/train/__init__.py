"""Training: the loop, optimizer and schedules, events and callbacks."""
