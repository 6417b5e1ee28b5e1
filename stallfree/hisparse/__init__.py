"""stallfree.hisparse"""
