"""breakers"""
