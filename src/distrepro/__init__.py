"""Reproducible parameter-server vs Horovod ResNet training workflow."""

import os

# tf-keras (Keras 2) is required by ParameterServerStrategy and horovod.keras;
# it must be chosen before TensorFlow is first imported, so it is set here,
# where every entry point of the package passes first.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
