"""How the processes torchrun starts are arranged: pipeline x data x tensor parallel, one DeviceMesh.

    torchrun --nproc-per-node 8 -m gpt train ... --pp 2 --tp 2      # 2 stages x 2 data replicas x 2 shards

    layout = mesh.Layout.of(world_size=8, tp=2, pp=2)   # Layout(pp=2, dp=2, tp=2)
    device_mesh = mesh.build(layout, "cpu")              # dims ("pp", "dp", "tp"), gloo on CPU
    layout.coordinates(rank)                             # (pp rank, dp rank, tp rank) of a process

The data-parallel size is what is left of the world once tensor and pipeline parallelism have taken
theirs: dp = world / (tp x pp). Ranks are laid out with tensor parallelism innermost (the processes
sharing a layer's matrices talk at every layer, so they are neighbours: on one node when tp fits in it),
then data, then pipeline outermost, as torchtitan orders its mesh. A process's data-parallel rank is what
picks its batches: the processes of one tensor-parallel group (and of one pipeline) read the same batch.

Footguns
- Every dimension is in the mesh, size 1 or not, so code can always ask for `device_mesh["tp"]`; a
  size-1 dimension's collectives are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt.errors import ConfigError

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    """How many processes along each dimension: pipeline stages, data replicas, tensor shards."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    @classmethod
    def of(cls, world_size: int, tp: int = 1, pp: int = 1) -> Layout:
        """The layout of `world_size` processes with `tp` shards and `pp` stages; the rest is data parallel."""
        for name, n in (("--tp", tp), ("--pp", pp)):
            if n < 1:
                raise ConfigError(f"{name}: must be >= 1, got {n}")
        if world_size % (tp * pp):
            raise ConfigError(
                f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the {world_size} processes torchrun started: "
                f"launch a multiple of {tp * pp} (torchrun --nproc-per-node N)"
            )
        return cls(pp=pp, dp=world_size // (tp * pp), tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pp rank, dp rank, tp rank) of global `rank`: tp innermost, pp outermost."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def __str__(self) -> str:
        return " x ".join(f"{name}={getattr(self, name)}" for name in DIMS)


def build(layout: Layout, device_type: str):
    """The DeviceMesh of the processes (the default process group must exist: torchrun + runtime.setup)."""
    from torch.distributed.device_mesh import init_device_mesh  # lazy: distributed

    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=DIMS)
