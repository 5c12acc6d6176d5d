import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
