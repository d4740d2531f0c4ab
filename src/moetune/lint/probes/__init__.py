"""Live probes: each demonstrates a rule's trap on the installed library versions, one
module an area; tiny.py builds the tiny models they share.

Each probe builds the smallest thing that shows its trap and returns whether it
reproduced, with the evidence; one that cannot run here raises ProbeUnavailable. Heavy
libraries are imported inside the probes so `moetune lint` never pays for them.
"""
