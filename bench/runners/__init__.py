"""runners"""
