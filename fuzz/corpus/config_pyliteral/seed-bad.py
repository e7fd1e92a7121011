{'a': 1,
 'b': Flase}