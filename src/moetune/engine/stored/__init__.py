"""Published quantised bases trained as stored (FP8, MXFP4, NVFP4, INT4, …): the formats
(formats.py), loading them (load.py), writing them (write.py) and their stored linears
(linear.py).
"""
