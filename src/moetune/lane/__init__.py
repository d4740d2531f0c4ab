"""Remote lane: run the same CLI stages on a rented GPU with every known wall handled first.

`walls` holds the sizing the walls need (pod volume, watchdog deadline, hf-xet, CI
timeouts); the lint rules and the providers both use it, so a check and a launch agree.
"""
