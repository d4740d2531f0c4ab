"""The base's routing: recorded per layer (recorder.py), the rows it is measured on
(rows.py) and the ESFT expert selection it drives (select.py).
"""
