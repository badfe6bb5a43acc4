package scripts

// RedisCRC64 is redisCRC64, for the tests.
var RedisCRC64 = redisCRC64
