"""A nested mpirun job for tests that launch their own (timeouts, exits):
the environment of the mpirun running the test is dropped, and a job that
outlives `timeout` is killed whole (its own session) and reported as hung."""
import os
import signal
import subprocess
import sys

MPIRUN = [os.environ.get("DDPX_MPIEXEC", "mpirun"), "--allow-run-as-root", "--oversubscribe",
          "--bind-to", "none"]


def run_job(np_, script_args, timeout, mpirun_extra=(), env_extra=None):
    """Runs `python script_args...` on np_ ranks. Returns (returncode, output),
    returncode None when the job hung and was killed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "OMPI_MCA_orte", "OMPI_MCA_ess"))}
    env.update(OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.Popen(MPIRUN + list(mpirun_extra) + ["-np", str(np_), sys.executable,
                                                           *map(str, script_args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out
