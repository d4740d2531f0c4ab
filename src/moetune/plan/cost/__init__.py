"""Time, money and pod sizing before anything is rented: the run's estimate
(estimate.py) and the infrastructure walls (walls.py).
"""
