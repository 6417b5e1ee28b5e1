"""stallfree.bench"""
