"""Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` as its users call it.
Usage: lightning_convert.py CHECKPOINT_DIR OUTPUT_FILE"""

import sys

from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

convert_zero_checkpoint_to_fp32_state_dict(sys.argv[1], sys.argv[2])
