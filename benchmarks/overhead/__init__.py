"""What does the transform itself cost? Trace and compile time, explain and find_overflow."""
