"""Live probes: each demonstrates a rule's trap on the installed library versions, one
module an area; tiny.py builds the tiny models they share.
"""
