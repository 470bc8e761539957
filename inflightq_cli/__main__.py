"""``python -m inflightq_cli``: the same commands as the ``inflightq`` script."""

from inflightq_cli import app

app(prog_name="inflightq")
