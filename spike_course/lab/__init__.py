"""The notebook's process code: what starts ranks, watches them and reads what they did.

Nothing here runs on the cluster: the launcher (warm, fresh and torchrun starts), the warm
start server, the per-rank progress bars, running a notebook headless, the capstone check's
two-node job, and the probes that record what a check's ranks did outside the answer's reach.
Worker scripts never import this package; the cluster side (``runtime``, ``protocol``,
``data``, ``models``) never imports it either.
"""
