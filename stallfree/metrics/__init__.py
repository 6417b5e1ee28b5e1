"""stallfree.metrics"""
