"""stallfree.runtime"""
