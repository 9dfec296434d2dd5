"""``ckptkit train``: the reference trainer, started through torch's own launcher (torchrun)."""

from __future__ import annotations

import os
import sys

import click

from ckptkit.train import build_parser

from .base import main


class _TrainCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        text = build_parser().format_help()
        formatter.write_paragraph()
        formatter.write_text("Every other option goes to the trainer (python -m ckptkit.train):")
        for line in text[text.index("options:") :].splitlines()[1:]:
            if "-h, --help" not in line:
                formatter.write(line + "\n")


@main.command(cls=_TrainCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--nproc", type=int, default=1, show_default=True, help="Processes on this node (GPUs, or CPU workers).")
@click.option("--nnodes", default="1", show_default=True, help="Nodes, or MIN:MAX for elastic runs.")
@click.option("--node-rank", type=int, default=None, help="This node's rank (static multi-node rendezvous).")
@click.option("--master-addr", default=None, help="Rank 0 node's address (static rendezvous).")
@click.option("--master-port", type=int, default=None, help="Rank 0 node's port (static rendezvous).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT for c10d rendezvous (elastic multi-node).")
@click.option("--rdzv-id", default=None, help="Job id shared by the nodes of one run.")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="Restart the group this often after a failure.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
def train(nproc: int, nnodes: str, node_rank: int | None, master_addr: str | None, master_port: int | None,
          rdzv_endpoint: str | None, rdzv_id: str | None, max_restarts: int, trainer_args: tuple[str, ...]) -> None:  # fmt: skip
    """Run the reference DDP trainer through torch's own launcher (torchrun).

    \b
    ckptkit train --nproc 2 --out runs/demo            # built-in task, resumes automatically
    ckptkit train --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --out /shared/run
    ckptkit train --nproc 4 --max-restarts 3 --model pkg.nets:make --data pkg.data:make --out runs/x
    """
    launcher = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts)]
    if node_rank is not None:
        launcher += ["--node-rank", str(node_rank)]
    if master_addr:
        launcher += ["--master-addr", master_addr]
    if master_port:
        launcher += ["--master-port", str(master_port)]
    if rdzv_endpoint:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint] + (["--rdzv-id", rdzv_id] if rdzv_id else [])
    if nnodes == "1" and not (master_addr or rdzv_endpoint):
        launcher.append("--standalone")  # one node: a free port, no address to configure
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "ckptkit.train", *trainer_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # torchrun takes over this process: signals reach it directly
