"""The runtime, by floor (imports go one way, share < serve < {eval, cluster}): ``share`` (tensor dedup,
IPC weight sharing), ``serve`` (the served model, engine and server), ``eval`` (lm-eval through the
served model) and ``cluster`` (workers, Ray, tensor parallel)."""
