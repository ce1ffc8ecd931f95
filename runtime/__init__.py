"""Runtime pieces: model building, the demo model pair and task evaluation."""
