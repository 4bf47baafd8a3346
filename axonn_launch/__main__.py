"""``python -m axonn_launch``: the launcher (``axonn_launch.cli``)."""

import sys

DEPENDENCIES = ("hydra", "omegaconf", "submitit", "yaml")  # the launcher's, not torch

MISSING_HINT = (
    "error: this Python lacks axonn_launch's dependencies ({missing}); run "
    "`bash machines/local/setup.sh` and use .venv/bin/python (or `pip install -e .`)"
)


def _main() -> None:
    from axonn_launch.scheduler.processes import start_early_supervisor

    start_early_supervisor(sys.argv[1:])  # a local job's imports start before Hydra's
    try:
        from axonn_launch.cli import main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in DEPENDENCIES:
            raise
        print(MISSING_HINT.format(missing=f"no module named {exc.name!r}"), file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    _main()
