"""Running subjobs: the Ray actor pinned to one slice, and its measurement of memory and time."""
