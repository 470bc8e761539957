"""The ``inflightq`` console script: a thin layer over the library.

Each subcommand imports its part lazily, so ``inflightq status`` never loads torch."""

from __future__ import annotations

import typer

app = typer.Typer(help="inflightq: Redis-backed LLM serving with continuous batching.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks; each prints a ratio against an anchor run in the same process.")
app.add_typer(bench_app, name="bench")


@app.command("settings")
def settings_table() -> None:
    """Print every INFLIGHTQ_* setting with its default, as the README's markdown table."""
    from shared.settings import Settings

    print("| variable | default | meaning |\n|---|---|---|")
    for name, field in Settings.model_fields.items():
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        shown = ",".join(default) if isinstance(default, list) else default
        print(f"| `INFLIGHTQ_{name.upper()}` | `{shown}` | {field.description} |")


@app.command("up")
def up(
    workers: int = typer.Option(1, min=1, help="Worker processes to start."),
    host: str | None = typer.Option(None, help="API bind address (default INFLIGHTQ_API_HOST)."),
    port: int | None = typer.Option(None, help="API port (default INFLIGHTQ_API_PORT)."),
) -> None:
    """Run everything on this machine: Redis (a private one if none answers), the API, the workers."""
    from shared.settings import get_settings
    from shared.supervisor import run_stack

    raise typer.Exit(run_stack(get_settings(), workers=workers, host=host, port=port))


if __name__ == "__main__":
    app()
