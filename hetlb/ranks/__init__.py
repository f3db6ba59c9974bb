"""What the ranks agree on and how they start: start-up agreement, elastic init, watchdog."""
