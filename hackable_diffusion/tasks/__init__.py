"""Tasks: a task is data (generator, formatting) plus metrics; add new tasks as sibling packages."""
