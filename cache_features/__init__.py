"""(placeholder: filled in by its stage)"""
