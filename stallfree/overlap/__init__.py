"""stallfree.overlap"""
