"""The vocabulary of the generated haystacks (written for this package; no word list is read from
the machine, so every machine builds the same prompts).

Nouns are countable and regular unless listed in ``haystack._PLURAL``; verbs are transitive base
forms with a regular third person singular; adjectives and adverbs are plain. The lists are split on
whitespace and deduplicated (first occurrence kept) by :mod:`xoffload.evals.haystack`.
"""

NOUNS = """
ability absence academy accent access accident account achievement acid acre action activity actor
adapter addition address adult advantage adventure advice affair agency agenda agent agreement airport
aisle alarm album alley alliance alphabet altitude amount analysis anchor angle animal ankle answer
antenna anthem apartment appetite apple appointment apron aquarium arch archive arena argument armchair
army arrow article artist aspect assembly asset assignment assistant athlete atlas atmosphere attempt
attention attic attitude audience author autumn avenue average award axis baby backpack badge bag
bakery balance balcony ball balloon ballot banana band bank banner bar barn barrel base basement basket
bath battery battle beach beam bean bear beard bed bedroom bee beetle beginning behavior bell belt bench
benefit berry bicycle bill biology bird birthday biscuit blanket blade block blossom blueprint board
boat body bone bonus book boot border bottle boulder boundary bowl box bracelet brain branch brand bread
breakfast brick bridge brother brush bubble bucket budget buffalo building bulb bundle bunker bureau bus
bush business butter button cabin cabinet cable cactus cafe cake calendar camel camera camp campaign
campus canal candle candy canoe canvas canyon capital captain car card career cargo carpet carriage
carrot cart case castle cat catalog category cathedral cave ceiling celebration cell cellar cement
center century ceremony chain chair chairman chalk challenge chamber champion channel chapter character
charity chart cheek cheese chemistry cherry chest chicken chimney chin chip chocolate choice chorus
church circle circus citizen city claim clarity class classroom clay client cliff climate clinic clock
closet cloth cloud clue coach coal coast coat code coffee coin collar colleague collection college
colony color column comb comedy comfort command comment committee community company comparison compass
competition complaint computer concept concert conclusion condition conference confidence conflict
connection consequence contest context contract contrast control conversation cook cookie copper copy
corner corridor costume cottage cotton couch council counter country county couple courage course court
cousin cover cow crab craft crane crater crayon cream creature credit creek crew cricket crime crisis
critic crop crowd crown cup cupboard curiosity current curtain curve cushion customer cycle dairy dam
dancer danger database date daughter deadline deal debate decade decision deck degree delivery demand
dentist department departure deposit desert design desk detail detective device diagram dialogue
diamond diary dictionary diet difference dinner direction director discount discovery discussion
disease dish distance district doctor document dog doll dolphin domain donkey door dot draft dragon
drama drawer drawing dream dress drill driver drop drum duck dust duty eagle ear earth economy edge
editor education effect effort egg elbow election electricity elephant elevator email embassy emotion
employee energy engine engineer entrance envelope environment episode equation equipment error escape
essay estate evening event evidence exam example exchange excuse exercise exhibit experience experiment
expert explanation expression factory failure fairy falcon family fan farm farmer fashion father faucet
fault feast feather feature fence ferry festival fever field figure file film filter finger fire
fireplace fish flag flame flavor fleet flight flood floor flower flute focus fog folder forest fork
format formula fortune forum fossil fountain fox frame freedom friend friendship frog fruit fuel
function funeral furniture future gallery game garage garden garlic gate gear gene generation gesture
ghost giant gift giraffe glacier glass glove glue goal goat gold golf government grain grammar
grandmother grape graph grass gravity group guard guest guide guitar habit hall hammer hand handle
harbor hat hawk head health heart heat helicopter helmet hero highway hill history hobby hole holiday
home honey hook horizon horn horse hospital hotel hour house hunger hurricane hut idea identity image
imagination impact income industry infant influence information injury ink insect inspector instance
instinct institute instruction instrument insurance interest interview invention investment invitation
island issue item jacket jar jelly jewel job journal journey judge juice jungle jury kettle key keyboard
kid kingdom kitchen kite kitten knee knot label laboratory ladder lake lamp land landscape language
lantern laptop laundry lawn lawyer layer leader lecture lemon lens lesson letter level library license
lid lifestyle light lighthouse limit line lion lip liquid list literature lizard lobby lobster location
lock locomotive log logic lounge luggage lunch machine magazine magnet mail manager map marble margin
market mask master match material meadow meal meaning measure medal medicine meeting melody member
memory menu merchant message metal method microphone minister minute mirror mission mistake mixture
model moment monitor monkey month monument moon morning mosquito mother motor mountain mouth movement
movie muffin muscle museum mushroom music musician mystery nail name napkin nation nature neck needle
neighbor nephew nerve nest network news newspaper night noise notebook novel number nurse nut oak
object ocean office officer onion opinion opportunity orange orbit orchard orchestra order organ origin
outcome oven owl owner oxygen package page pain painting pair palace pan panel paper parade parcel
parent park parrot partner party passenger passport pasta path patience patient pattern pause payment
peach peak peanut pear pebble pen pencil penguin pension pepper performance period permission person
pet phase phone photo phrase piano picture pie piece pig pigeon pillow pilot pine pipe pirate pizza
place plan planet plant plate platform player playground pleasure plot pocket poem poet point police
policy pond pool population porch port portrait position post pot potato powder power practice prayer
preference presence president pressure price pride priest prince principle printer priority prison
prize problem process product professor profile profit program project promise proof property proposal
protest province pudding pump pumpkin pupil puppet puppy purpose puzzle pyramid quality quantity
quarter queen question queue rabbit race radio rail rain rainbow range rate reaction reader reality
reason receipt recipe record recovery reflection region relation relief religion report request
research reserve resident resource response restaurant result review revolution reward rhythm ribbon
rice riddle ride rifle ring risk river road robot rock rocket role roof room root rope rose route
routine rubber rule ruler sail salad salary salmon salt sample sand sandwich satellite sauce scale
scarf scene schedule scheme scholar school science scientist score screen script sculpture season seat
second secret secretary section sector seed selection sense sentence series servant service session
setting shadow shape share shark sheep shell shelter sheriff ship shirt shock shoe shop shore shoulder
shovel show shower sidewalk signal silence silk silver singer sink sister situation size skill skin
skirt sky slope smile smoke snack snake snow soap soccer society sock sofa software soil soldier
solution song sound soup source space speaker species speech speed spider spirit sponge spoon sport
spring square squirrel stable stadium staff stage stair stamp standard star state station statue steam
step stick stomach stone storage store storm story stove strategy straw stream street strength string
structure student studio style subject submarine success sugar suggestion suit summer summit sun supper
supply surface surgeon surprise survey sweater symbol system table tablet tail tailor talent tank tape
target task taste tax taxi tea teacher team tear technology telephone telescope television temper
temperature temple tennis tent term territory test text texture theater theme theory thing thread
throat thunder ticket tiger timber time tire title toast toe toilet tomato tone tongue tool tooth topic
tornado tower town toy track tractor trade tradition traffic trail train transport trap tray treasure
treaty tree trend trial triangle trick trip trophy truck trumpet trunk trust truth tube tulip tune
tunnel turkey turtle tutor umbrella uncle uniform union unit universe university valley value van
variety vase vegetable vehicle velvet version vessel victory video view village violin virus visitor
voice volcano volume vote voyage wagon waiter wall wallet war wardrobe warehouse warning watch water
wave wealth weapon weather website wedding week weekend weight whale wheat wheel whistle window wine
wing winner winter wire witness wizard wolf wood word worker workshop world worm writer yard year
yogurt zebra zone acorn anvil apricot arcade armor attorney bagel ballad bamboo bandit barber bargain
barley basin bay beacon bishop blizzard bouquet boxer breeze broom buckle buffet bugle bulletin butler
cabbage cactus camper canopy caravan cardinal carnival carpenter cashier cauldron cedar cello chapel
chariot chef cinema citrus clam cobweb cocoa comet compost condor coral cornfield cosmos cougar cradle
crescent crystal cucumber cylinder daisy dune dwarf eclipse emerald engraving falconer fern fig firefly
fjord flamingo flannel flask fleece foam forge freckle furnace galaxy gazelle geyser ginger glider
goblet gondola gorilla granite gravel grove gull hamlet harp hazel hedge heron hive hound hurdle
iceberg igloo ivory jaguar jasmine jigsaw kayak kennel lagoon lark lava leopard lettuce lilac lime
linen llama locket loom lotus lynx mango mantle maple marsh meteor mill minnow mint moat mole mosaic
moss moth nectar nickel oasis oatmeal olive opal otter paddle pagoda panther papaya parsley pasture
pavilion pearl pelican pendant peony pepperoni pinecone plum poppy prairie prism pulley quartz quill
quilt raccoon raft rattle raven reed reef rhino ripple robin rooster ruby saddle saffron sapphire
sardine scooter seashell sequoia shrub skyline sleigh sloth sparrow spinach spire sprout stallion
starfish stork sunflower swan sycamore tambourine tangerine teapot thistle thimble tortoise trellis
trout tulip tuba tundra turnip twig valve vault vine vineyard vulture walnut walrus warbler waterfall
weasel willow windmill wren yacht
"""

ADJECTIVES = """
able absolute abstract academic accurate active actual adequate advanced afraid aggressive alert alive
amazing ambitious ancient angry annual anxious apparent appropriate arctic artificial astonishing
attractive automatic available average aware awful awkward basic beautiful bitter blank blind blond
bold bored boring brave brief bright brilliant broad broken brown busy calm capable careful careless
casual central certain cheap cheerful chilly civil classic clean clear clever close cloudy clumsy
coastal cold colorful comfortable common competent complete complex confident conscious constant
content cool correct cozy crazy creative crisp critical crooked crucial cruel curious curly current
cute daily damp dark dear decent deep defiant delicate delicious dense dependent desperate detailed
different difficult digital diligent direct dirty distant divine dizzy domestic dramatic dry dull
dusty eager early eastern easy economic efficient elaborate elastic elderly electric elegant eloquent
empty endless energetic enormous entire equal essential eternal ethical even evident exact excellent
exotic expensive experienced explicit external extra extreme fabulous faint fair faithful false
familiar famous fancy fantastic fast fatal favorite fearless federal fierce final financial fine firm
fiscal flat flexible fluffy foggy foolish foreign formal former fortunate fragile frank free frequent
fresh friendly frozen functional funny fuzzy gentle genuine gifted glad global glossy golden good
gorgeous graceful gradual grand grateful great green grim guilty handsome handy happy hard harsh
healthy heavy helpful hidden high historic holy honest hopeful horizontal hostile hot huge humble
hungry icy ideal identical idle illegal immense immune impartial implicit important impossible
impressive independent indirect industrial inevitable informal initial inner innocent intact intense
internal invisible ironic jealous jolly joyful junior keen kind large late lazy legal lengthy level
liberal likely limited linear little lively local logical lonely long loose loud lovely loyal lucky
lunar magic main major mature meaningful medical mellow mental messy mighty mild military minor mobile
modern modest moral mutual mysterious narrow national native natural naval neat necessary negative
nervous neutral new nice noble noisy normal northern notable numerous obvious odd official old open
optimal oral ordinary organic original outer overall pale parallel partial passive peaceful perfect
permanent personal physical plain pleasant plastic polite popular portable positive possible potential
powerful practical precious precise pretty previous primary prime private probable productive
professional profound prominent proper proud public pure purple quick quiet radical random rapid rare
raw ready real recent red regional regular relevant reliable remote rich rigid ripe robust romantic
rough round royal rural sacred sad safe salty satisfied scarce scary secure selfish senior sensible
sensitive separate serious severe shallow sharp shiny short shy significant silent silly similar
simple sincere single skinny sleepy slim slow small smart smooth soft solar solid sour southern spare
special specific spicy splendid stable steady steep sticky stiff straight strange strict strong
stubborn subtle successful sudden sufficient suitable sunny superb sweet swift symbolic tall tame
tender tense terrible thick thin thirsty thorough tidy tight tiny tired total tough tropical true
typical ugly ultimate unique universal unusual upper urban urgent useful usual vacant vague valid
valuable vast verbal vertical vibrant violent virtual visible visual vital vivid warm wealthy weary
weekly weird western wet whole wicked wide wild wise wooden worried worthy yellow young zealous amber
azure breezy bumpy crimson dainty dapper drowsy dusky earthy feeble fiery frosty gleaming gloomy
grassy hasty hazy hollow humid jagged leafy lofty mossy muddy murky nimble plump prickly quaint rocky
rosy rusty sandy scarlet shabby shaggy silky snowy soggy sparkling stormy sturdy swampy tangy tawny
thorny velvety wavy windy woolly
"""

VERBS = """
accept achieve acquire adapt address adjust admire admit adopt advise affect afford allow alter
analyze announce answer anticipate appreciate approach approve arrange assemble assess assign assist
attach attract avoid balance borrow build calculate capture carry catch celebrate challenge change
chase check choose claim clarify clean climb collect combine command compare compose conceal confirm
connect consider construct consult contain continue control convert convince copy correct create
criticize cultivate cure damage debate decide declare decorate defend define deliver demonstrate deny
describe design destroy detect determine develop discover discuss dismiss display distribute divide
document doubt draw earn edit educate eliminate embrace emphasize employ enable encourage endorse enjoy
enlarge ensure enter establish estimate evaluate examine exchange expand expect explain explore
express extend fetch fill finance find fix follow forecast forgive form frame gather generate grab
grasp greet guard guide handle harvest hide highlight hire hold identify ignore illustrate imagine
improve include increase influence inform inherit inspect inspire install interpret interrupt
introduce invent investigate invite judge justify keep lead learn lift limit list locate maintain
manage map mark master measure mend mention merge mix modify monitor motivate move name navigate need
negotiate notice observe obtain offer open operate order organize overcome paint pack perform persuade
pick plan plant play polish predict prefer prepare present preserve prevent print produce program
promote protect prove provide publish pull purchase pursue push question raise reach read rebuild
receive recognize recommend record recover reduce refine reflect reform refuse regard reject release
remember remove renew repair repeat replace report represent request require rescue research reserve
resolve respect restore retain reveal review revise reward risk rotate sample save scan schedule
search secure select sell send separate serve settle shape share shift show simplify sketch solve sort
spend split spread steer store study submit suggest summarize supply support surprise survey sustain
teach test thank track trade train transform translate transport treat trust understand unite update
upgrade use value verify visit wash watch weigh welcome win wrap write absorb accompany accumulate
activate admire advertise align amuse anchor applaud appoint archive arrest assure audit await bake
bargain bend bless boil boost brew bury calibrate carve chop circulate classify coach comfort
compile complete compress conduct confront conserve coordinate count craft crush cultivate
customize decode dedicate delay delegate deploy deposit derive detach diagnose dig direct disclose
dissolve draft drain dress dry elect elevate embed encode endure engage enrich erase escort examine
exhibit export fasten favor feed filter flatten fold foster freeze fund gain grind hang harness heal
heat hunt import inflate insert insure iron irrigate join kick knit label launch lend light load
lock mentor mold mount observe outline own paddle paint patch pause peel pitch please plow polish
pour praise print protect punish quote rank ration recycle redeem register reinforce relocate rent
rescue reshape restrict rinse roast rule scatter scrub seal season sew shelter shield shuffle sift
signal slice smooth soak sponsor squeeze stack stir stitch strengthen stretch subtract sweep tame tap
taste thread tighten toast tolerate trace trim tune twist unlock unpack unwrap vacuum wander warn
water weave whisper wipe
"""

ADVERBS = """
quietly rarely often usually always sometimes never seldom clearly carefully easily quickly slowly
really truly simply certainly probably perhaps honestly frankly suddenly gradually eventually finally
recently already still merely nearly mostly largely partly fully deeply widely greatly highly strongly
closely directly openly gently firmly boldly calmly eagerly freely happily silently proudly wisely
barely hardly entirely exactly naturally obviously surely rapidly steadily smoothly roughly briefly
constantly frequently occasionally regularly typically generally specifically especially particularly
primarily originally initially ultimately seriously genuinely reasonably remarkably surprisingly
unusually curiously patiently politely bravely cheerfully gracefully loosely neatly swiftly warmly
"""

PREPOSITIONS = """
in on near behind beside under over across along around after before during without within beyond
among through toward against inside outside above below from beneath past
"""
