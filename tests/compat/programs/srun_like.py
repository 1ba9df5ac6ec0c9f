"""A launcher as srun or mpirun is to a job: starts N copies of a command, each with its rank in the
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and Slurm's SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID), and waits. Imports no torch. ``python srun_like.py N CMD ...``"""

import os
import socket
import subprocess
import sys


def main() -> int:
    n, cmd = int(sys.argv[1]), sys.argv[2:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(n):
        env = {
            **os.environ,
            "RANK": str(r),
            "WORLD_SIZE": str(n),
            "LOCAL_RANK": str(r),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SLURM_PROCID": str(r),
            "SLURM_NTASKS": str(n),
            "SLURM_LOCALID": str(r),
        }
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


if __name__ == "__main__":
    raise SystemExit(main())
