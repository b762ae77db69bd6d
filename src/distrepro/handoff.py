"""What the launcher and the training processes hand each other, besides the
run's config.yaml: files in the run directory and environment variables."""

# Written by a training process whose data is damaged: restarting cannot help.
DAMAGED_DATA = "damaged_data.txt"
# Present while a finished run's record has not reached the MLflow server.
TRACKING_BEHIND = "mlflow_behind"
# The launcher's terminal, where the chief draws its progress bar.
TERMINAL = "DISTREPRO_TERMINAL"
# Set by the network experiment for the launcher it starts on its hosts.
ON_SHAPED_HOSTS = "DISTREPRO_ON_SHAPED_HOSTS"
# Horovod's autotuning log (strategy.autotune), an artifact of the run.
AUTOTUNE_LOG = "horovod_autotune.csv"
