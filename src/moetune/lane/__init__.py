"""Remote lane: run the same CLI stages on a rented GPU with every known wall handled first.

The sizing the walls need (pod volume, watchdog deadline, hf-xet, CI timeouts) and the
time/cost estimate live in `moetune.plan.cost.walls` and `moetune.plan.cost.estimate`: the lint
rules and the providers both use them, so a check and a launch agree, and lane/ sits on top of
plan/ and recipe/ (nothing below the lane imports it).
"""
