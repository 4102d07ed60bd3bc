"""Terminal front ends: ``llmsys chat`` (Textual app + plain REPL) and ``llmsys monitor``.

Imports the engine, never the server: the monitor reads ``/metrics`` over HTTP.
"""
