"""The bottom layer every llmsys package may import: errors, units, paths, protocols.

It lives at the base of the lowest package (``kernels``) because the top-level
folders are fixed; nothing here imports any other part of llmsys, so
``kernels``, ``quant``, ``offload``, the engine and the front ends can all share
one error type, one size parser, one ``$LLMSYS_HOME`` and the structural types
they hand each other without importing upwards.
"""
