"""The `embedlens` command line: Typer app, command registration, and usage-error handling."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

try:
    import typer
    from typer.core import TyperCommand, TyperGroup

    from embedlens.cli import addr as _addr
    from embedlens.cli import lens as _lens
    from embedlens.cli import neighbors as _neighbors
    from embedlens.cli import params as _params
    from embedlens.cli import tied as _tied
    from embedlens.cli import tune as _tune
    from embedlens.cli import vocab as _vocab
    from embedlens.cli._errors import report_error, report_terminated
    from embedlens.cli._output import silence_stdout, write_stdout
    from embedlens.cli._scratch import (
        TERMINATED,
        make_scratch,
        remove_scratch,
        unwind_on_sigterm,
    )
    from embedlens.compat.click import help_at_spaces as help_text
    from embedlens.errors import EmbedlensError
except KeyboardInterrupt:  # Ctrl-C while the command line is still being imported: quiet too
    raise SystemExit(130) from None


def _show_help(ctx: Any, param: Any, value: bool) -> None:
    """--help: the help written as the commands write their output, so that a stdout that
    cannot take it (closed with `>&-`, full) is an error, not a silent exit 0."""
    if value and not ctx.resilient_parsing:
        write_stdout(help_text(ctx) + "\n")
        ctx.exit()


class _HelpChecked:
    """A command whose --help is written by _show_help (Click's echo skips a closed stdout)."""

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.callback = _show_help
        return option


PANELS = ("Input", "Sites", "Decoder", "Comparison", "Output", "Loading", "Runtime")
"""The --help panels options name (`rich_help_panel`), in the order they are shown."""


class _Command(_HelpChecked, TyperCommand):
    """A subcommand (its --help checked, its options under the panels they name)."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Arguments, then the options in their `rich_help_panel`'s section (the plain help,
        which Typer writes without panels), panels in `PANELS`' order (then any other in the
        order its first option comes), those without one last under 'Options'."""
        args: list[tuple[str, str]] = []
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                name = getattr(param, "rich_help_panel", None) or "Options"
                panels.setdefault(name, []).append(record)
        order = [*PANELS, *(name for name in panels if name not in PANELS), "Options"]
        panels = {name: panels[name] for name in dict.fromkeys(order) if name in panels}
        for title, rows in (("Arguments", args), *panels.items()):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class _Group(_HelpChecked, TyperGroup):
    """Report usage errors as one `error:` line (exit 2) instead of Typer's panel."""

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        try:
            rv = super().main(
                args=args,
                prog_name=prog_name,
                complete_var=complete_var,
                standalone_mode=False,
                **extra,
            )
        except EmbedlensError as e:  # writing the help or the version: stdout closed or full
            if not standalone_mode:
                raise
            report_error(e.message, e.hint, e.exit_code)
            sys.exit(e.exit_code)
        except OSError as e:  # writing the help: the commands' own output is checked in them
            if not standalone_mode:
                raise
            silence_stdout()
            if isinstance(e, BrokenPipeError):
                sys.exit(0)
            report_error(f"cannot write the output to stdout: {e.strerror or e}")
            sys.exit(1)
        except Exception as e:
            code = getattr(e, "exit_code", None)
            if not hasattr(e, "format_message") or not isinstance(code, int):
                raise
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
                try:
                    write_stdout(help_text(ctx) + "\n")
                    code = 0
                except EmbedlensError as failed:
                    report_error(failed.message, failed.hint, failed.exit_code)
                    code = failed.exit_code
            else:
                command = ctx.command_path if ctx is not None else self._named(args)
                report_error(e.format_message(), f"see '{command} --help'", code)
            if not standalone_mode:
                raise
            sys.exit(code)
        if standalone_mode:
            sys.exit(rv if isinstance(rv, int) else 0)
        return rv

    def _named(self, args: Any) -> str:
        """'embedlens COMMAND' for the command the words name (Click's error for an option's
        missing value carries no context), else 'embedlens'."""
        words = list(args) if args is not None else sys.argv[1:]
        name = next((w for w in words if not str(w).startswith("-")), None)
        return f"embedlens {name}" if name in self.commands else "embedlens"


app = typer.Typer(
    cls=_Group,
    name="embedlens",
    help="Open up both ends of a causal LM: the embedding table, the LM head, the logit lens.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: typer.rich_utils costs a third of the start-up
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from embedlens import __version__

        write_stdout(f"embedlens {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Show the version and exit."
        ),
    ] = False,
) -> None:
    """Open up both ends of a causal LM: the embedding table, the LM head, the logit lens."""


def _register(command: Any, examples: str) -> None:
    """Add a command; its --help ends with its examples, then its page of the manual (docs/ in
    the source), which holds every option."""
    epilog = f"{examples}\n\n  Reference: docs/{command.__name__}.md"
    app.command(cls=_Command, epilog=epilog)(command)


_register(_params.params, _params.EXAMPLES)
_register(_tied.tied, _tied.EXAMPLES)
_register(_lens.lens, _lens.EXAMPLES)
_register(_neighbors.neighbors, _neighbors.EXAMPLES)
_register(_addr.addr, _addr.EXAMPLES)
_register(_vocab.vocab, _vocab.EXAMPLES)
_register(_tune.tune, _tune.EXAMPLES)


def main() -> None:
    """Console entry point.

    Once torch has been imported, interpreter teardown costs about half a second of module
    finalisation that nothing here needs; after flushing the output, the process leaves at once.
    """
    from embedlens.runtime import own_process

    own_process()  # the process tuning only the command line takes (embedlens.runtime)
    code: int | str | None = 0
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:  # a path that is not UTF-8 is printed as its bytes, as ls does
        reconfigure(errors="surrogateescape")
    unwind_on_sigterm()
    scratch = make_scratch()
    try:
        app()
    except SystemExit as e:
        code = e.code
        if code == TERMINATED:
            report_terminated()
    except KeyboardInterrupt:
        code = 130
    finally:
        remove_scratch(scratch)
    if "torch" not in sys.modules:
        sys.exit(code)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    if isinstance(code, str):
        sys.stderr.write(code + "\n")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(status)
