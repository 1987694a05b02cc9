"""Data package: pretrained policies (NAME.zip with NAME.json)."""
